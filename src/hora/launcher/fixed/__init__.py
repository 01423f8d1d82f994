"""The driver of a fixed-size ``hora run`` job."""
