"""What users touch: the pipeline and its generation handles, argument resolution, text in and out,
streaming, progress bars, the dashboard and the integrations (see ARCHITECTURE.md)."""
