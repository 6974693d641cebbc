"""Who used what: prices, the usage ledger and what is read from it.

    money          micro-dollar arithmetic, and a model entry's `price:` read into the domain's Price
    settings       the `usage:` section
    ledger         LedgerRow: one row per admitted request, built from its telemetry record
    writer         LedgerWriter: batches rows off the request path into a LedgerSink, retries, drops counted
    spool          LedgerSpool: each queued row also on disk until written, adopted by the next process if this dies
    schema         the ledger's migrations (component "usage")
    sqlite_ledger, postgres_ledger   the two sinks (stores.open_ledger picks one by the key store's settings)
    query          the SQL both sinks share: totals per bucket and group, rows newest first
    latency        the usage results' latency percentiles, from per-bound counts
    openai_pages   OpenAI's usage and costs pages (and Portico's request list) from those totals and rows
    report         `portico usage`
"""
