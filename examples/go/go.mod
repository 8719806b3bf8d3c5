module example.com/postie-producer

go 1.21

require (
	github.com/jackc/pgx/v4 v4.18.3
	github.com/rabbitmq/amqp091-go v1.10.0
)
