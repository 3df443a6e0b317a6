"""Built-in example tasks."""
