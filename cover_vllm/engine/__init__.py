"""The engine loop: requests in, schedule -> execute -> decide -> update, outputs out."""
