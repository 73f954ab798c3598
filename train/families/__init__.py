"""Drafter families: a family is a folder (`dflash/`: DFlash and DFlash 2) behind the
interface of `train.families.family`, and a row of the registry `train.families.kinds`.
The trainer, loader, evaluation, decoding, export and dry run reach a family only
through the registry."""
