"""The prefill service: computes a prompt's KV and first token, and writes the KV into
a decode worker's blocks over kvtransfer while later chunks still compute."""
