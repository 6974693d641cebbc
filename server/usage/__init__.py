"""Who used what: prices, the usage ledger and what is read from it.

    money          micro-dollar arithmetic, Price (per model, from the configuration)
    settings       the `usage:` section
    ledger         LedgerRow: one row per admitted request, built from its telemetry record
    writer         LedgerWriter: batches rows off the request path into a LedgerSink, retries, drops counted
    schema         the ledger's migrations (component "usage")
    sqlite_ledger, postgres_ledger   the two sinks (stores.open_ledger picks one by the key store's settings)
    query          the SQL both sinks share: totals per bucket and group, rows newest first
    openai_pages   OpenAI's usage and costs pages (and Portico's request list) from those totals and rows
    report         `portico usage`
"""
