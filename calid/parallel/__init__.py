"""Model parallelism as transformations of a loaded model (no distributed code in the model itself)."""
