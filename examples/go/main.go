// Command publish publishes one email job to postie (see "The message contract" in
// the README).
//
//	cd examples/go
//	go mod tidy   # once: fetches amqp091-go and writes go.sum
//	go run . -to alice@example.com -delay-ms 10000
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//	-amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
//	-prefix    POSTIE_PREFIX   postie   (publishes to exchange "<prefix>.delayed")
//	-key       EMAIL_KEY       demo-<unix ms>:welcome
//	-to        EMAIL_TO        alice@example.com
//	-delay-ms  EMAIL_DELAY_MS  5000     (0 = send now)
//
// On success it prints one line, "published key=<key> exchange=<x> delay_ms=<n>",
// once the broker has confirmed the job. Any failure exits non-zero.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const routingKey = "email"

type settings struct {
	amqpURL string
	prefix  string
	key     string
	to      string
	delayMs int64
}

func envOr(name, fallback string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return fallback
}

func parseSettings() (settings, error) {
	var s settings
	flag.StringVar(&s.amqpURL, "amqp-url", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"), "RabbitMQ URL")
	flag.StringVar(&s.prefix, "prefix", envOr("POSTIE_PREFIX", "postie"), "postie's topology prefix")
	// In a real service the key comes from your business data, e.g.
	// "order-42:order_confirmation", so that publishing the same event twice (a
	// retry, a redelivery) collides and yields one email. The time-based default
	// only lets this example run repeatedly.
	flag.StringVar(&s.key, "key", envOr("EMAIL_KEY", fmt.Sprintf("demo-%d:welcome", time.Now().UnixMilli())), "idempotency key")
	flag.StringVar(&s.to, "to", envOr("EMAIL_TO", "alice@example.com"), "recipient")
	delay := flag.String("delay-ms", envOr("EMAIL_DELAY_MS", "5000"), "delay in milliseconds (0 = now)")
	flag.Parse()
	ms, err := strconv.ParseInt(*delay, 10, 64)
	if err != nil {
		return s, fmt.Errorf("delay must be an integer number of milliseconds, not %q", *delay)
	}
	if ms < 0 {
		ms = 0
	}
	s.delayMs = ms
	return s, nil
}

// publish sends the job and returns once the broker has confirmed it.
func publish(ctx context.Context, s settings) error {
	body, err := json.Marshal(map[string]any{
		"key":     s.key,
		"from":    "Shop <noreply@shop.example>",
		"to":      []string{s.to},
		"subject": "Welcome!",
		"text":    "Hello from the Go producer example.",
		"html":    "<p>Hello from the <b>Go</b> producer example.</p>",
	})
	if err != nil {
		return err
	}

	conn, err := amqp.Dial(s.amqpURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()

	// Publisher confirms: the broker acks (or nacks) every publish on this channel.
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1))
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))

	err = ch.PublishWithContext(ctx, s.prefix+".delayed", routingKey,
		false, // not mandatory: the delayed-message plugin returns every delayed
		// publish as unroutable yet delivers it later
		false,
		amqp.Publishing{
			DeliveryMode: amqp.Persistent,
			ContentType:  "application/json",
			Headers: amqp.Table{
				// int64: sent as an AMQP integer, as the contract asks.
				"x-delay": s.delayMs,
				// The due time counts from here, even if postie is down right now.
				"postie-published-at": time.Now().UnixMilli(),
			},
			Body: body,
		})
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}

	select {
	case c, ok := <-confirms:
		if !ok {
			return errors.New("the channel closed before the broker confirmed")
		}
		if !c.Ack {
			return errors.New("the broker nacked the publish")
		}
		return nil
	case e := <-closed:
		// E.g. 404 when the exchange does not exist: the broker closes the channel.
		if e != nil {
			return fmt.Errorf("the broker closed the channel: %w", e)
		}
		return errors.New("the channel closed before the broker confirmed")
	case <-ctx.Done():
		return fmt.Errorf("no confirm: %w", ctx.Err())
	}
}

func main() {
	s, err := parseSettings()
	if err != nil {
		fmt.Fprintln(os.Stderr, "publish failed:", err)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := publish(ctx, s); err != nil {
		fmt.Fprintln(os.Stderr, "publish failed:", err)
		os.Exit(1)
	}
	fmt.Printf("published key=%s exchange=%s.delayed delay_ms=%d\n", s.key, s.prefix, s.delayMs)
}
