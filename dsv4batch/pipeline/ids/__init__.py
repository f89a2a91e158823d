"""Row ids: derived when INPUT has none (`derive`), checked and matched against OUTPUT before
scoring (`scan`), and the rows a resumed run still has to score (`rowset`)."""
