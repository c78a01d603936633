"""The study of compiled-shape caching: see README.md."""
