"""The demo checkpoint's two chat templates.

The model has one task: transcribe the image. ``TRAIN`` is ChatML with Qwen2-VL's vision
placeholders (models/tiny.py's, without the default system turn: tokens are characters here)
and renders whatever the prompt says: training draws its prompts (demo/batches.py) and keeps
this template, so the recipe's samples stay what they were.

``SERVE`` is the template the shipped checkpoint carries (chat_template.jinja and
chat_template.json, written by ``write_serving``): every user turn becomes its images and
videos followed by ``INSTRUCTION``, the prompt training used most, whatever text the user
wrote; system turns (and tool turns) are left out; assistant turns are kept. So every prompt
of every client reads alike, and HF transformers, which applies the checkpoint's template,
builds the very prompt the engine does. For an image then ``INSTRUCTION`` the two templates
render the same text (tests/test_demo_template.py).
"""
from __future__ import annotations

import json
import os

INSTRUCTION = "Transcribe all the text on this page, in reading order."

_MEDIA = ("{% if content['type'] in ('image', 'image_url') %}"
          "<|vision_start|><|image_pad|><|vision_end|>"
          "{% elif content['type'] in ('video', 'video_url') %}"
          "<|vision_start|><|video_pad|><|vision_end|>")
TRAIN = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}" + _MEDIA +
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SERVE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|im_start|>user\n"
    "{% if message['content'] is not string %}{% for content in message['content'] %}"
    + _MEDIA + "{% endif %}{% endfor %}{% endif %}" + INSTRUCTION + "<|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_serving(ckpt: str) -> None:
    """Give the checkpoint at ``ckpt`` the serving template (the tokenizer's
    chat_template.jinja and the processor's chat_template.json)."""
    with open(os.path.join(ckpt, "chat_template.jinja"), "w") as f:
        f.write(SERVE)
    with open(os.path.join(ckpt, "chat_template.json"), "w") as f:
        json.dump({"chat_template": SERVE}, f, indent=2)
        f.write("\n")
