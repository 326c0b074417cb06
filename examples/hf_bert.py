"""Hugging Face BERT (BertForMaskedLM), random weights:
2 layers, width 64, vocab 1000.

Traced by fxpipe with torch.export (non-strict); inputs are a keyword dict.
The definitions live in transformers_models.py next to this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # find transformers_models

from transformers_models import bert_inputs as example_inputs
from transformers_models import bert_target as example_target
from transformers_models import build_bert as build_model
from transformers_models import loss_fn

__all__ = ["build_model", "example_inputs", "example_target", "loss_fn"]
