"""Model builders for executed runs (the composed ``model`` config -> a trainable module)."""
