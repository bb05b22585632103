"""What a person reads: findings, figures, the front page, predicted against measured."""
