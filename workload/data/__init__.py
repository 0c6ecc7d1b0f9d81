"""Token batches, a pure function of (seed, step): where they come from and how they are read.

batches      synthetic and file sources and the per-process batches built from them (`Batches`)
packing      whole documents packed into fixed-length rows, from a plan built once
records      ArrayRecord token files: one record per document
text         documents of text files (jsonl, parquet, text), tokenized on the fly
tokenizer    the tokenizer of text data: Hugging Face tokenizer.json or SentencePiece, and the EOS
prepare      `tpujob data prepare`: text tokenized once into ArrayRecord files
chat         conversations for `objective: sft`: the chat template, the loss on the assistant's tokens
files        which files a `files` source reads (one rule for the sources and the fingerprint)
readahead    a process's rows read ahead of the loop in worker threads, through Grain (`ReadAhead`)
fingerprint  what decides the data order, recorded with every checkpoint and checked on resume
"""
