"""epd: disaggregated encode / prefill / decode serving, as its users import it.

This package holds only the generated protocol bindings (`epd.v1`, which import nothing of
ours) and the public client (`epd.client`). The `epd` command line, the Ray pools and the
deployment settings are the `cluster` package; `python -m epd` runs that command line.
"""
