"""The router's OpenAI-compatible HTTP API (FastAPI, served by uvicorn in the router's loop).

schema.py   the request bodies (pydantic), as OpenAI's API reference names them
media.py    media URLs -> bytes: data URLs; local files and https only when allowed
convert.py  a request body -> `GenerateRequest` (the gRPC front door's message)
errors.py   RouterError / bad fields -> OpenAI's error body and HTTP status
stream.py   `GenerateResponse` chunks -> chat.completion(.chunk) / text_completion JSON
app.py      the endpoints, auth, and the uvicorn server started and stopped with the router
connections which connections uvicorn keeps (a cap; a time for each request head)
serve.py    the API started beside the router's gRPC server
"""
