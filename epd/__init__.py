"""epd: disaggregated encode / prefill / decode serving.

`epd.v1` holds the generated protocol bindings; `epd.cli` is the `epd` command line.
"""
