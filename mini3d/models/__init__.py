"""The model: its configuration (families, presets, every field), the reference transformer that
every parallel layout must reproduce, and the key/value cache that sampling puts in its attention."""
