"""Generator: JSON Schemas → attrs record classes, stream registry and reference docs."""
