"""Drafter directories other code loads: export, import, and fine-tuning from one."""
