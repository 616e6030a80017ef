"""The structure half of the structured-outputs schema suite (tests/structured_schemas.py holds
the rest and the suite's description): `$defs`/`$ref`, booleans and nulls, a top-level array,
tool-call arguments, tuples, nested arrays, type unions, arrays of objects, deep nesting, formatted
arrays, and the two unbounded cases."""

from schema_validation import SchemaCase, bounded_str

STRUCTURE_SCHEMAS: list[SchemaCase] = [
    SchemaCase(
        "order_defs_ref",  # $defs reused through $ref
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"street": bounded_str(40), "city": bounded_str(30)},
                    "required": ["street", "city"],
                    "additionalProperties": False,
                },
                "line_item": {
                    "type": "object",
                    "properties": {
                        "product": bounded_str(30),
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
                "items": {"type": "array", "items": {"$ref": "#/$defs/line_item"}, "minItems": 1, "maxItems": 3},
                "shipping": {"$ref": "#/$defs/address"},
                "billing": {"$ref": "#/$defs/address"},
            },
            "required": ["order_id", "items", "shipping", "billing"],
            "additionalProperties": False,
        },
        "Give a JSON order: an order id, one to three line items (product, quantity), shipping and billing addresses.",
        example={
            "order_id": 1042,
            "items": [{"product": "Lamp", "quantity": 2}],
            "shipping": {"street": "5 Main St", "city": "Springfield"},
            "billing": {"street": "5 Main St", "city": "Springfield"},
        },
    ),
    SchemaCase(
        "shop_booleans_nulls",
        {
            "type": "object",
            "properties": {
                "is_open": {"type": "boolean"},
                "has_parking": {"type": "boolean"},
                "closed_reason": {"type": "null"},
                "manager": {"type": ["string", "null"], "maxLength": 30},
            },
            "required": ["is_open", "has_parking", "closed_reason", "manager"],
            "additionalProperties": False,
        },
        "Give a JSON shop status: is it open, does it have parking, why it is closed (null), its manager or null.",
        example={"is_open": True, "has_parking": False, "closed_reason": None, "manager": None},
    ),
    SchemaCase(
        "leaderboard_top_level_array",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"player": bounded_str(20), "score": {"type": "integer", "minimum": 0, "maximum": 1000}},
                "required": ["player", "score"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 5,
        },
        "Give a JSON array of up to five players on a leaderboard, each with a player name and a score.",
        example=[{"player": "zed", "score": 950}, {"player": "amy", "score": 870}],
    ),
    SchemaCase(
        "get_weather_arguments",  # OpenAI's function-calling example, strict mode
        {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "City and country e.g. Bogotá, Colombia",
                    "maxLength": 40,
                },
                "units": {
                    "type": ["string", "null"],
                    "enum": ["celsius", "fahrenheit", None],
                    "description": "Units the temperature will be returned in.",
                },
            },
            "required": ["location", "units"],
            "additionalProperties": False,
        },
        "Call get_weather for the weather in Paris, France, in celsius. Give only the JSON arguments.",
        example={"location": "Paris, France", "units": "celsius"},
    ),
    SchemaCase(
        "map_point_tuple",  # prefixItems: a fixed-length tuple
        {
            "type": "object",
            "properties": {
                "label": bounded_str(30),
                "point": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "number", "minimum": -90, "maximum": 90},
                        {"type": "number", "minimum": -180, "maximum": 180},
                    ],
                    "items": False,
                    "minItems": 2,
                },
            },
            "required": ["label", "point"],
            "additionalProperties": False,
        },
        "Give a JSON map marker for the Eiffel Tower: a label and a [latitude, longitude] point.",
        example={"label": "Eiffel Tower", "point": [48.8584, 2.2945]},
    ),
    SchemaCase(
        "tic_tac_toe_nested_arrays",
        {
            "type": "object",
            "properties": {
                "board": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"enum": ["X", "O", " "]},
                        "minItems": 3,
                        "maxItems": 3,
                    },
                    "minItems": 3,
                    "maxItems": 3,
                },
                "next_player": {"enum": ["X", "O"]},
            },
            "required": ["board", "next_player"],
            "additionalProperties": False,
        },
        'Give a JSON tic-tac-toe position: a 3x3 board of "X", "O" or " " and whose turn is next.',
        example={"board": [["X", "O", " "], [" ", "X", " "], ["O", " ", " "]], "next_player": "X"},
    ),
    SchemaCase(
        "ticket_type_union",  # "type" as a list of types, and an enum mixing types
        {
            "type": "object",
            "properties": {
                "ticket": {"type": ["integer", "string"], "minimum": 1, "maximum": 99999, "maxLength": 12},
                "priority": {"enum": [1, 2, 3, "urgent", None]},
            },
            "required": ["ticket", "priority"],
            "additionalProperties": False,
        },
        'Give a JSON support ticket: its ticket number or code, and its priority (1, 2, 3, "urgent" or null).',
        example={"ticket": "INC-7", "priority": "urgent"},
    ),
    SchemaCase(
        "review_rating_enum",  # an integer enum, titles and descriptions
        {
            "title": "Review",
            "type": "object",
            "properties": {
                "product": {"title": "Product", "type": "string", "maxLength": 30},
                "stars": {"title": "Stars", "description": "From 1 to 5", "enum": [1, 2, 3, 4, 5]},
                "verdict": {"enum": ["recommend", "avoid"]},
                "summary": {"type": "string", "minLength": 5, "maxLength": 40},
            },
            "required": ["product", "stars", "verdict", "summary"],
            "additionalProperties": False,
        },
        "Give a JSON review of a coffee maker: product, stars from 1 to 5, a verdict and a one-line summary.",
        example={"product": "BrewMaster 3000", "stars": 4, "verdict": "recommend", "summary": "Fast and quiet."},
    ),
    SchemaCase(
        "recipe",  # arrays of objects and of strings together
        {
            "type": "object",
            "properties": {
                "name": bounded_str(30),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"item": bounded_str(20),
                                       "grams": {"type": "integer", "minimum": 1, "maximum": 2000}},
                        "required": ["item", "grams"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 4,
                },
                "steps": {"type": "array", "items": bounded_str(40), "minItems": 1, "maxItems": 3},
                "vegetarian": {"type": "boolean"},
            },
            "required": ["name", "servings", "ingredients", "steps", "vegetarian"],
            "additionalProperties": False,
        },
        "Give a JSON recipe for pancakes: name, servings, up to four ingredients with grams, up to three steps, "
        "and whether it is vegetarian.",
        example={
            "name": "Pancakes",
            "servings": 4,
            "ingredients": [{"item": "flour", "grams": 200}, {"item": "milk", "grams": 300}],
            "steps": ["Mix everything.", "Fry in a pan."],
            "vegetarian": True,
        },
    ),
    SchemaCase(
        "company_deep_nesting",  # four levels of objects
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": bounded_str(30),
                        "department": {
                            "type": "object",
                            "properties": {
                                "name": bounded_str(30),
                                "team": {
                                    "type": "object",
                                    "properties": {
                                        "name": bounded_str(30),
                                        "lead": {
                                            "type": "object",
                                            "properties": {
                                                "name": bounded_str(30),
                                                "years": {"type": "integer", "minimum": 0, "maximum": 50},
                                            },
                                            "required": ["name", "years"],
                                            "additionalProperties": False,
                                        },
                                    },
                                    "required": ["name", "lead"],
                                    "additionalProperties": False,
                                },
                            },
                            "required": ["name", "team"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "department"],
                    "additionalProperties": False,
                },
            },
            "required": ["company"],
            "additionalProperties": False,
        },
        "Give a JSON object for a company with one department, its team, and the team lead's name and years.",
        example={
            "company": {
                "name": "Acme",
                "department": {"name": "Research", "team": {"name": "Rockets", "lead": {"name": "Wile", "years": 7}}},
            }
        },
    ),
    SchemaCase(
        "calendar_attendees",  # an array of formatted strings, and a nullable date
        {
            "type": "object",
            "properties": {
                "event": bounded_str(30),
                "day": {"type": "string", "format": "date"},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "format": "email", "maxLength": 40},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "rsvp_by": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
            },
            "required": ["event", "day", "attendees", "rsvp_by"],
            "additionalProperties": False,
        },
        "Give a JSON calendar event: a name, the day, one to three attendee emails, and an RSVP date or null.",
        example={
            "event": "Launch party",
            "day": "2025-06-01",
            "attendees": ["a@example.com", "b@example.com"],
            "rsvp_by": None,
        },
    ),
    SchemaCase(
        "story_unbounded",
        {
            "type": "object",
            "properties": {"title": bounded_str(40), "story": {"type": "string"}},
            "required": ["title", "story"],
            "additionalProperties": False,
        },
        "Write a short story about a robot as JSON with a title and the story.",
        bounded=False,
        example={"title": "Rusty", "story": "Rusty the robot learned to paint sunsets."},
    ),
    SchemaCase(
        "notes_unbounded",
        {
            "type": "object",
            "properties": {"topic": bounded_str(30), "notes": {"type": "array", "items": {"type": "string"}}},
            "required": ["topic", "notes"],
            "additionalProperties": False,
        },
        "Give JSON study notes about photosynthesis: the topic and a list of notes.",
        bounded=False,
        example={"topic": "Photosynthesis", "notes": ["Plants turn light into sugar.", "Chlorophyll absorbs light."]},
    ),
]
