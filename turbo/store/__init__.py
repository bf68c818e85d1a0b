"""An install on disk, read as stored: the architecture (config.json), the quantized formats, the
safetensors headers and the open layout, the install's files and its template files, the shapes
a part must hold. The bottom of the house: it imports nothing of turbo's but errors and bounds."""
