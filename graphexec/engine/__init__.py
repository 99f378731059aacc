"""The decode loop: `DecodeExecutor` (admit -> launch -> prefill -> collect -> finish), its
slot table, captured graphs, the step they replay, and the asyncio front end."""
