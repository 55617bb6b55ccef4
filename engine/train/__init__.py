"""The recipe that makes builtin:strata-tiny: corpus, tokenizer, packing, joint next-token + MTP training, export.

Run it with `python -m engine.train --help`. Nothing here is imported by the serving engine; the model itself
comes from `engine.model` so that what is trained is exactly what the loader serves.
"""
