"""The tokenizer kinds; :mod:`eqmoe.data.tokenizer` loads one and names them all."""
