"""distdoctor: find the bugs that make distributed PyTorch training silently wrong, slow or stuck."""

__version__ = "0.1.0"
