"""Training objectives beyond next-token prediction: supervised fine-tuning on chat (sft), T5 span corruption (t5)."""
