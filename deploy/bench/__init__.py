"""`tandem bench disagg`: tandem up topologies under the serving benchmark (W4, W6)."""
