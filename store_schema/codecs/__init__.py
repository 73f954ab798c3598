"""How the store's arrays become bytes and back: the bf16 and fp8 splits, zstd, the shard
file and the zarr data types. No file layout: the caller says where bytes go."""
