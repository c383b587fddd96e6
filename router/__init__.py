"""The router: P0's side of the pools (layout, routing, supervision, migration)."""
