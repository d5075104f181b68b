"""The replica fleet: backends, health, in-flight counts and scraped engine metrics."""
