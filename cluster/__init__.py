"""The `epd` command line, the Ray pools it runs, and the one TOML file for every role."""
