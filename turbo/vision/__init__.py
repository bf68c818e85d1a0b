"""Images in (docs/vision.md): the Qwen3.5 vision tower (tower.py, its config config.py), image
preprocessing as transformers' Qwen2-VL-style processor does it (image.py), and the trunk's
multimodal rotary positions (positions.py); the runtime's side of them
(runtime.py: generate(images=), chat image parts) and chat sessions with images (session.py)."""
