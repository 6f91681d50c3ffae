"""Request flows: parsing and validating bodies, prompts and templates, output parsers, and the
generation of one request's choices."""
