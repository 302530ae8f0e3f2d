"""From a data file to padded micro-batches: read records, render chats, mask prompts, cache, sample."""
