"""Layer 4, reporting: report.json, the text rendering, the HTML page with plots and trace, the
iteration-time model with its bandwidth curve, and the collective microbenchmarks."""
