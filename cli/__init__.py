"""kvxfer's command line: demo, plan, bench."""
