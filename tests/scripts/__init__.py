"""Programs and exporter modules that tests run in other processes."""
