"""The proxy: pure routing decisions and the listeners that execute them."""
