"""Stores on object storage (`s3://`, `gs://` through obstore): the commit protocol without rename or lock."""
