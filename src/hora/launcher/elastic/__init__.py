"""The driver of an elastic ``hora run`` job: its hosts, its worlds and its workers."""
