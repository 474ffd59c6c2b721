"""Instruction tuning: the generated multi-domain task set (`tasks`), jsonl instruction data with
the loss on responses (`dataset`) and exact-match evaluation by greedy generation (`evaluate`)."""
