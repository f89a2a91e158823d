"""Bundled sample data (`sample.parquet`) and the script that builds it (`make_sample`)."""
