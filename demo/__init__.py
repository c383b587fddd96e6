"""The built-in demo model that reads: synthetic printed text (render.py), the training
recipe (train.py) and the trained checkpoint shipped in ``ocr_demo/`` (docs/demo-model.md)."""
