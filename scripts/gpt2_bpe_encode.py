#!/usr/bin/env python
"""GPT-2 BPE-encode text files into space-separated token ids, one output line per input line:

    python scripts/gpt2_bpe_encode.py --encoder-json gpt2_bpe/encoder.json --vocab-bpe gpt2_bpe/vocab.bpe \
        --inputs wiki.train.raw --outputs wiki.train.bpe --keep-empty --workers 8

The encoder is fairseq_tnn/commands/gpt2_bpe.py (its docstring says what it does); --help lists the options.
"""
from fairseq_tnn.commands.gpt2_bpe import main

if __name__ == "__main__":
    main()
