"""The router: epd's front door (RouterService), worker registry and admin service.

`router.server.serve(settings)` starts it in-process; `python -m router` runs it as a
process. Request flow and lease ownership: `router.orchestrator`; registration rules and
worker selection: `router.registry`.
"""
