"""Training recipes: one readable file per recipe wiring trainer components."""
