"""Typed settings: the TOML/flag mechanism (`schema`) and the bases every role extends."""
