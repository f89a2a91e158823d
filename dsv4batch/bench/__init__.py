"""`python -m dsv4batch.bench NAME [--json] [args]` runs `bench/NAME.py:main(argv)` from the repository."""
