"""The running guard, no HTTP: verdict cache, checker, replica views, incidents, heals, the Guard value."""
