"""Who used what: prices, the usage ledger and what is read from it.

    money        micro-dollar arithmetic, Price (per model, from the configuration)
    settings     the `usage:` section
    ledger       LedgerRow: one row per admitted request, built from its telemetry record
    writer       LedgerWriter: batches rows off the request path into a LedgerSink, retries, drops counted
    sqlite_ledger / query   the SQLite sink and the aggregation both sinks share
"""
