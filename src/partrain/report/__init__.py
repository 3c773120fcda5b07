"""Reports: plots of benchmark results (``plots``)."""
