"""kvxfer's command line: demo, plan, diff, golden, schema, run, bench."""
